"""Launchers: where worker processes run. ``local`` spawns them on this machine
(:mod:`dynarl.launch.local`); a Ray launcher places them across nodes."""
