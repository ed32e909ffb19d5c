"""Saving a step, in the order it happens: ``plan`` (which rank writes which chunk, and where in
its pack), the ``pipeline``'s threads (stage into host memory, write the pack, commit), and
``commit`` (all ranks or none). ``handle`` is what ``Checkpointer.save`` returns."""
