"""pagefleet.cluster"""
