"""The agent's and the tools' seam to the Kubernetes API server (credentials, client, and what they ask of it)."""
