"""The physical half of the prefix cache: each block's arrays, recurrent-state snapshots, and the SSD tier."""
