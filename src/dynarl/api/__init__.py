"""The public surface: the configuration tree, its loaders, and (later) the facade."""
