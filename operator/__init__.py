"""kvpilot operator: the InferenceDeployment CRD reconciled into daemons, autoscaled on KV-cache pressure."""

GROUP = "kvpilot.io"
VERSION = "v1alpha1"
PLURAL = "inferencedeployments"
KIND = "InferenceDeployment"
