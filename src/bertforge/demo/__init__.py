"""The demo: the library's steps end to end on public data fetched from PyPI (`bertforge demo`)."""
