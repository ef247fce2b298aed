"""Images and videos in requests: loading (media.py, video.py, fetch.py), content hashes (hashing.py),
and the vision-embedding cache (vision_cache.py, the only module here that imports MLX).

Nothing is re-exported here, so the API layer can import media.py without pulling in MLX.
"""
