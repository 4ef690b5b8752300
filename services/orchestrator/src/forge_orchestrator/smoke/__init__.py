"""The platform's smoke job: the ``smoke`` workflow (a no-op job through the scheduler, its events
back through Kafka), its input and result, and the API's check of its input."""
