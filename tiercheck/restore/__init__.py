"""Restoring a step, in the order it happens (``protocol`` drives it): ``agree`` on the step,
``plan`` who reads which chunks, ``match`` the saved tree to the live state, ``read`` and verify the
chunks into memory ``stage`` prepares, then hand them to the live tensors. ``load`` reads a step
into plain tensors without a live state."""
