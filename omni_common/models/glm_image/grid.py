"""GLM-Image's token grid, which the family's checks and the prior's inputs both follow: the AR
model makes one image token per 32x32 pixels, and the DiT's 16-pixel patches upsample that grid
2x, so output sizes and condition images are multiples of 32."""

AR_PATCH = 32  # pixels per AR image token
