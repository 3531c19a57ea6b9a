"""Attention backends: write K/V into paged slots, attend over ragged queries with block tables.
The interface is base.py; selector.py picks a backend and sizes its cache."""
