"""Tasks: prompt sources, verifiers, and the embedded synthetic task.

None of these modules imports torch.
"""
