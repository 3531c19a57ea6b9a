"""Deployment beyond one machine: Ray cluster launcher configs and the KubeRay manifests' generator."""
