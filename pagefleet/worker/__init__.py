"""pagefleet.worker"""
