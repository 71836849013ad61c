"""CLI subcommands. Each module holds small argument dataclasses and the functions that run them; a command that
runs a library entry point takes that entry point's options from `bertforge.options` (see `base.command_args`).

Modules here import only the standard library and torch-free bertforge modules (options, recipes, errors) at the
top, so `bertforge --help` is instant; heavy imports (torch, tokenizers) happen inside the run functions.
"""
