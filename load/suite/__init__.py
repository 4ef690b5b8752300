"""The load suite: scenarios that start their own services, drive them, and check thresholds."""
