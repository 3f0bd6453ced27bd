"""The kvpilot.io API's coordinates: group, version, and each kind's plural and name."""

GROUP = "kvpilot.io"
VERSION = "v1alpha1"
PLURAL = "inferencedeployments"
KIND = "InferenceDeployment"
LORA_PLURAL = "loraadapters"
LORA_KIND = "LoRAAdapter"
