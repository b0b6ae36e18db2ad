"""Operator tools: the ``kvtier`` CLI, ``kvtier report``, ``kvtier replay`` and the demo."""
