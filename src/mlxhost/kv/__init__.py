"""The KV cache. The modules here are its logical half (block pool, prefix cache, chained hashes, blocks in
flight) and import no MLX; `kinds/` knows each layer cache kind and its block I/O, `store/` keeps the
blocks' arrays in memory and on the SSD tier."""
