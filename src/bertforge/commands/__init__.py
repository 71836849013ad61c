"""CLI subcommands. Each module holds small argument dataclasses and the functions that run them.

Modules here import only the standard library at the top, so `bertforge --help` is instant; heavy imports
(torch, tokenizers) happen inside the run functions.
"""
