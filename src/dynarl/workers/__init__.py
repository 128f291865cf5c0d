"""Workers: role interfaces, typed handles and the worker process main; one backend per
subpackage (``torch``, ``sglang``, ``megatron``), imported lazily by name."""
