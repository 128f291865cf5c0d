"""Scheduling policies, one per module; each implements
:class:`dynarl.control.scheduler.Policy`."""
