"""The RL algorithm: advantages, the GRPO loss, trajectories into minibatches, and a
reference in-process loop.

Import the modules directly (``dynarl.rl.grpo``, ``dynarl.rl.loop``): the loss and the
loop need torch, and ``import dynarl.rl`` stays light.
"""
