# meshgate node image: slim Python, the project installed from this checkout,
# run as an unprivileged user. Secrets come from the environment at run time
# (docker-compose.yml reads demo.env), never from the image.
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml README.md ./
COPY meshgate ./meshgate
RUN pip install --no-cache-dir . \
 && useradd --system --uid 10001 --home /var/lib/meshgate --create-home meshgate
COPY examples /etc/meshgate/examples
USER meshgate
ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["meshgate"]
CMD ["run"]
