"""Readable pure-Python oracles, written from the upstream semantics; every native path is diffed
against them."""
