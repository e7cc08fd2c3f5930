"""`minidecode bench`'s measurements (e2e.py: end to end against transformers; batch.py: batched
decode; report.py: the tables and files they write). They drive the public API; the runtime never
imports them (tests/test_layers.py)."""
