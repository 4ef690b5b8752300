"""The request path after admission of the tenant: aliases and canaries, shadow copies, admission to a replica, and the router that forwards."""
