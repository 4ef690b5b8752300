"""The replica set: its members, their load and health, the upstream client, the autoscaling signal and token metering."""
