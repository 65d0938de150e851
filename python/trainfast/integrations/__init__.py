"""Swap trainfast's functions into the real upstream modules: ``patch()`` / ``unpatch()`` per package."""
