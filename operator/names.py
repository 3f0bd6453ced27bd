"""The InferenceDeployment API's coordinates: group, version, plural and kind."""

GROUP = "kvpilot.io"
VERSION = "v1alpha1"
PLURAL = "inferencedeployments"
KIND = "InferenceDeployment"
