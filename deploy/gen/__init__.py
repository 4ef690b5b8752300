"""The pieces of ``deploy/generate.py``: each module builds one kind of deployment file.

``common`` holds what they share (names, ports, the settings and secrets of each service);
``compose`` builds docker-compose.yml, ``k8s`` the Kubernetes manifests, ``monitoring`` the
Prometheus, alerting and Grafana files, ``images`` the Dockerfiles. ``deploy/generate.py`` puts
them together and writes the files.
"""
