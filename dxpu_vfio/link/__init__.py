"""The wire between a host proxy and a remote proxy: framing, one endpoint per stream, TLS."""
