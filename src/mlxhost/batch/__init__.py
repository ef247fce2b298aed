"""The Batch API's state and work, below HTTP: the store on disk (files, batches, answered lines), the input file's
lines and the output shapes, and the runner that answers them through a dispatch the HTTP side gives it."""
