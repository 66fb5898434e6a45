"""The pool manager (DxPU_MANAGER): which pooled device goes to which VM.

``store`` keeps boxes, devices and leases in SQLite; ``targets`` reaches a VM through
its QMP socket or through libvirt; ``manager`` does attach/detach/reconcile atomically;
``service`` serves the local API and Prometheus metrics that the CLI uses.
"""
