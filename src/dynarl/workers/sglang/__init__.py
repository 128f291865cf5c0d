"""The SGLang rollout backend: :class:`~dynarl.workers.sglang.rollout.SGLangRollout`
speaks an SGLang 0.5.x server's HTTP API (its own msgspec definitions of the requests
it uses, in :mod:`~dynarl.workers.sglang.messages`; nothing is imported from
``sglang``), on servers it launches or ones the user runs.

Importing this package imports nothing heavy; the backend table loads
:mod:`dynarl.workers.sglang.backend` (and httpx) only when a run uses it.
"""
