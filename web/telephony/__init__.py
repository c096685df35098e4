"""The telephony doors of the web front: phone calls as Converse sessions (docs/telephony.md)."""
