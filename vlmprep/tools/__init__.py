"""Dataset tools that read a built dataset: inspect, view, show, report, stats, verify. They never import the build."""
