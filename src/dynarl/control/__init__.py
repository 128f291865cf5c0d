"""The control plane: the hypergraph model of the pipeline, the scheduler and its
policies, the predictor, and the controller loop.

Everything here except :mod:`dynarl.control.controller` is pure and synchronous: no
sockets, no awaits, no clock reads. It imports nothing from ``data``, ``workers`` or
``sim``.
"""
