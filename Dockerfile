# omnistage service image: one image, every service (`omnistage serve <service>`).
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY omnistage ./omnistage
COPY omni_common ./omni_common
COPY services ./services
# torch comes from PyPI with the project's range (a CUDA build on x86_64, which also runs on
# CPU); pre-install a CPU wheel first for a smaller CPU-only image.
RUN pip install .

# Models are mounted at /models (see docker-compose.yml); nothing is downloaded at run time.
EXPOSE 50051 50061 50062 50063 8000
CMD ["omnistage", "serve", "coordinator"]
