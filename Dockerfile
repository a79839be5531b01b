# omnistage service image: one image, every service (`omnistage serve <service>`).
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1

# The lock pins torch's CPU build (2.13.0+cpu), which PyPI does not serve: point pip at an index
# or a folder of wheels that has it (docker build --build-arg PIP_EXTRA_INDEX_URL=... or
# PIP_FIND_LINKS=...). Every other package comes from PyPI, checked against the lock's hashes.
ARG PIP_EXTRA_INDEX_URL=""
ARG PIP_FIND_LINKS=""

WORKDIR /app
COPY requirements.lock ./requirements.lock
RUN pip install --require-hashes --no-deps -r requirements.lock
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY omnistage ./omnistage
COPY omnistage_cli ./omnistage_cli
COPY omni_common ./omni_common
COPY services ./services
RUN pip install --no-deps --no-build-isolation .

# Models are mounted at /models (see docker-compose.yml); nothing is downloaded at run time.
EXPOSE 50051 50061 50062 50063 8000
CMD ["omnistage", "serve", "coordinator"]
