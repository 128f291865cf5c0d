"""The RL algorithm: advantages, the GRPO loss, trajectories into minibatches, and an
iteration's requests.

Import the modules directly (``dynarl.rl.grpo``, ``dynarl.rl.batch``): the loss needs
torch, and ``import dynarl.rl`` stays light. The in-process reference loop the
distributed run must agree with is the torch backend's
(:mod:`dynarl.workers.torch.reference_loop`).
"""
