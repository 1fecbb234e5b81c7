"""`kubectl ipmasq uninstall`: ipmasq off every node where its agent wrote rules, and out of the API, leaving
everything that is not ipmasq's (a provider's addon, a Helm chart's objects, the user's ConfigMap) as it is.

    ipmasq.ownership        what is ipmasq's: the labels it puts on what it ships and makes, and the judgement
    uninstall/plan.py       what an uninstall does, decided from what was read (pure)
    uninstall/nodepod.py    the pod that removes the rules on one node, and its report (pure)
    uninstall/cluster.py    reading the cluster once, then doing the plan (through ipmasq.kube.client)

The command's flags and output are the kubectl plugin's (ipmasq.kubectl_plugin); nothing here imports the CLI.
"""
