"""The lab: throwaway network namespaces where rules meet real packets."""
