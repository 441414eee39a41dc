"""Experimental decode paths: opt-in, slower than the defaults so far, kept for measurement (see README.md)."""
