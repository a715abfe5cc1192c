"""The scheduler service: forms dynamic batches from the Redis queues and dispatches them."""
