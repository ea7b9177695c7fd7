"""Speculation control: whether a step speculates (`controller`), how large its trees are
(`tree_sizer`), how a draining batch judges it (`draining`), and which sequences get trees
(`backoff`)."""
