"""The one owner of meshserve's Redis layout: key schema (keys.py), encodings and policy (store.py)."""
