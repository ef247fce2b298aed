"""Layer cache kinds: what each can do (batch, rewind, store) and how its blocks are read and written."""
