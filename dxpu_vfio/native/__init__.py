"""Native (C) pieces of the data path: the message stream (stream.py, fastlink.c)."""
