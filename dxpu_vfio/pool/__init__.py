"""The pool manager (DxPU_MANAGER): which pooled device goes to which VM.

``store`` keeps boxes, devices and leases in SQLite (schema, allocation); ``boxes``
fetches inventories and probes boxes; ``manager`` does attach/detach/reconcile atomically;
``service`` serves the local API and Prometheus metrics that the CLI uses.
"""
