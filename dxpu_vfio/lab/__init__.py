"""The lab: namespaces, veth links, delay injection, remote proxies; one command up, one down."""
