"""Images on the user's side of a vision model: where they come from and how they are decoded
(:mod:`.intake`), and how a decoded image becomes the pixel array the artifact's
``encode_image`` takes and the prompt positions it fills (:mod:`.processor`). numpy and Pillow
only: nothing here needs torch."""
