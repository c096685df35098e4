"""The WebRTC door of the web front: a browser peer connection as one Converse session, its
signalling (offers, WHIP), tracks and ICE sockets."""
