"""OpenAI's Files and Batch APIs as a front door: routes over the batch store, and the dispatch that runs each line
through the server's own route for its endpoint."""
