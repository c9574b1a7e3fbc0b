"""zerowatch.dashboards"""
