"""`ipmasq webhook`: a validating admission webhook for the agent's ConfigMaps.

review.py decides (pure); certificate.py makes the serving certificate; keeper.py keeps it, shared by every replica
through a Secret, and the webhook configuration's caBundle current; kube.py makes its API calls through
ipmasq.kube.client; server.py serves AdmissionReview over TLS, and worker.py decides the large reviews in a process
of its own. Only `ipmasq webhook` imports this package (its
dependencies are the `webhook` extra): the agent never does.
"""
